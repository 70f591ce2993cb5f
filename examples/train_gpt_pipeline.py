"""Train a tiny GPT-style decoder over 2 pipeline stages: `train_t5_pipeline.py` with ``--model gpt-tiny``.

    python examples/train_gpt_pipeline.py --steps 30
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_t5_pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_model="gpt-tiny"))
