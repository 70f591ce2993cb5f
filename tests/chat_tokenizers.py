"""Tiny local transformers tokenizers with chat templates, for the chat-template tests (no hub).

A WordLevel vocabulary split on whitespace, so a rendered conversation's ids are easy to write down
by hand: `ids` looks the words up directly (the reference the tests compare with).
"""

from __future__ import annotations

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|tool|>",
            "<image>"]
WORDS = ("hi hello how are you fine thanks weather sunny the is what in get_weather city paris rome tools "
         "a b c d e").split()
VOCAB = {w: i for i, w in enumerate(SPECIALS + WORDS)}
IMAGE_ID = VOCAB["<image>"]

# A conversation: every turn "<|role|> content <|end|>", assistant turns trained (generation blocks).
# Tools: their names listed in a leading system block; an assistant tool call renders as
# "get_weather city <city>"; tool results are "<|tool|> content <|end|>" turns.
GEN = (
    "{{ bos_token }}"
    "{% if tools %}<|system|> tools {% for t in tools %}{{ t.function.name }} {% endfor %}<|end|> {% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|> {% generation %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }} city {{ c.function.arguments.city }} "
    "{% endfor %}{% else %}{{ m.content }} {% endif %}<|end|>{% endgeneration %} "
    "{% else %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
#: The same rendering without {% generation %} markers: assistant tokens come from rendered prefixes.
NO_GEN = GEN.replace("{% generation %}", "").replace("{% endgeneration %}", "")
#: Renders the last turn differently from earlier ones ("the" after it): prefixes do not match.
UNSTABLE = NO_GEN.replace("{% endfor %}{% if add_generation_prompt %}",
                          "{% if loop.last %}the {% endif %}{% endfor %}{% if add_generation_prompt %}")
#: Contents as lists of parts ({"type": "image"} / {"type": "text"}), as vision-language templates take them.
PARTS = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|> {% generation %}{{ m.content }} <|end|>{% endgeneration %} "
    "{% else %}<|{{ m.role }}|> {% for p in m.content %}{% if p.type == 'image' %}<image> {% else %}{{ p.text }} "
    "{% endif %}{% endfor %}<|end|> {% endif %}{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def ids(text: str) -> list[int]:
    """The reference ids of a rendering: its whitespace-separated words looked up in the vocabulary."""
    return [VOCAB[w] for w in text.split()]


def make_tokenizer(template: str | None = GEN, fast: bool = True):
    """A transformers tokenizer over `VOCAB` with ``template`` as its own chat template (None: none)."""
    import tokenizers as tk
    import transformers

    raw = tk.Tokenizer(tk.models.WordLevel(VOCAB, unk_token="<unk>"))
    raw.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(SPECIALS)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = template
    return tok
