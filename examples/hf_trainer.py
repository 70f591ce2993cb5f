"""datasets + an in-process BPE tokenizer + a small Llama + transformers.Trainer, with dynabatch forming
the steps: python examples/hf_trainer.py [DATA.jsonl(.gz) with inputs/targets, or "" for generated] [SAMPLES]"""
import sys, tempfile
import datasets, tokenizers, torch, transformers
import dynabatch
from dynabatch import PlanOptions, Tokenization
from dynabatch.datagen import text_records

limit = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
ds = (datasets.load_dataset("json", data_files=sys.argv[1], split="train") if len(sys.argv) > 1 and sys.argv[1]
      else datasets.Dataset.from_list(text_records(limit, seed=0)))
ds = ds.select(range(min(limit, len(ds)))).select_columns(["inputs", "targets"])
bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
bpe.train_from_iterator((r["inputs"] + r["targets"] for r in ds),
                        tokenizers.trainers.BpeTrainer(vocab_size=2000, special_tokens=["<pad>", "<eos>", "<unk>"]))
tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
loader = dynabatch.DataLoader(ds, options=PlanOptions(global_batch_tokens=16384, max_len=1024),
                              tokenization=Tokenization(tokenizer=tok))
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, pad_token_id=tok.pad_token_id))
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), num_train_epochs=1, learning_rate=3e-3,
                                      logging_steps=2, report_to=[], save_strategy="no", disable_tqdm=True,
                                      use_cpu=not torch.cuda.is_available())
trainer = dynabatch.DynabatchTrainer(model=model, args=args, train_loader=loader)
print(f"{len(ds)} samples -> {len(loader)} steps, planned for {loader.cost.device.name} ({loader.cost.model.name})")
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print(f"global_step {trainer.state.global_step}, epoch {trainer.state.epoch:.2f}, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
