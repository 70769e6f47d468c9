"""Benchmark inputs built on the spot (air-gapped machines, no downloads): a random-weight model of a
real shape (app/tiny.py presets) and an SFT parquet whose samples are about --tokens long.

    python scripts/bench_data.py OUT_DIR --preset qwen2.5-1.5b --tokens 2104 --rows 512

writes OUT_DIR/model/ and OUT_DIR/sft.parquet (a `messages` column, as verl's SFT dataset reads).
Each sample is GSM8K questions (user) and their worked answers (assistant) from the bundled copy,
repeated until the chat-templated sample reaches the token target, so lengths are realistic but even.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.common import atomic_path, say  # noqa: E402
from app.tiny import BUNDLED_GSM8K, write_tiny_model  # noqa: E402


def build_rows(tokenizer, rows: int, target: int) -> list[dict]:
    import itertools

    from tqdm import tqdm

    with gzip.open(BUNDLED_GSM8K, "rt", encoding="utf-8") as handle:
        source = [json.loads(line) for line in handle]
    pool = itertools.cycle(source)
    out = []
    for _ in tqdm(range(rows), desc="samples", unit="row"):
        user, assistant = [], []
        while True:
            row = next(pool)
            user.append(row["question"])
            assistant.append(row["answer"])
            messages = [{"role": "user", "content": "\n\n".join(user)},
                        {"role": "assistant", "content": "\n\n".join(assistant)}]
            # transformers 5 returns a BatchEncoding here unless return_dict=False
            n = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
            if n >= target:
                break
        out.append({"messages": messages, "n_tokens": n})
    return out


def main() -> int:
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--tokens", type=int, default=2104)
    parser.add_argument("--rows", type=int, default=512)
    args = parser.parse_args()
    out = Path(args.out)
    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        write_tiny_model(model_dir, preset=args.preset)
        say(f"wrote {args.preset} model to {model_dir}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = build_rows(tokenizer, args.rows, args.tokens)
    frame = pd.DataFrame(rows)
    with atomic_path(out / "sft.parquet") as tmp:
        frame.to_parquet(tmp)
    lengths = frame["n_tokens"]
    say(f"wrote {len(frame)} rows to {out / 'sft.parquet'}: tokens min {lengths.min()} "
        f"mean {lengths.mean():.0f} max {lengths.max()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
