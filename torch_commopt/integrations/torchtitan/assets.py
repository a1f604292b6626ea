"""Synthetic assets for a torchtitan debug run on a machine without network access.

    python -m torch_commopt.integrations.torchtitan.assets OUT_DIR [--docs N]

writes OUT_DIR/tokenizer/ (tokenizer.json + tokenizer_config.json: a word-level tokenizer of
VOCAB words plus begin/end-of-text tokens, built with the `tokenizers` package torchtitan
already needs) and OUT_DIR/c4_test/data.json (N documents, one JSON object {"text": ...} a
line, the layout of torchtitan's "c4_test" data set), for

    --model.hf_assets_path OUT_DIR/tokenizer --training.dataset_path OUT_DIR/c4_test

The text is drawn from a fixed first-order Markov chain over the words (seeded, so every rank
and every run write the same files), so a model can learn it: the loss of a debug run falls
from ~ln(vocab) towards the chain's entropy.  It measures plumbing and speed, not language
modelling; torchtitan's own tokenizer and c4_test come with a full checkout of its git tag.
"""

from __future__ import annotations

import argparse
import json
import os
import random

VOCAB = 500          # words; the debug model's vocabulary is 2048
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def write_debug_assets(out_dir: str, docs: int = 2000, words_per_doc: int = 400, seed: int = 0) -> tuple[str, str]:
    """Write the tokenizer and the data set under out_dir; returns (tokenizer_dir, dataset_dir)."""
    tok_dir, data_dir = os.path.join(out_dir, "tokenizer"), os.path.join(out_dir, "c4_test")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    words = [f"w{i}" for i in range(VOCAB)]
    _write_tokenizer(tok_dir, words)
    rng = random.Random(seed)
    # each word is followed by one of 4 successors: entropy ln 4 ~ 1.39 nats per token
    successors = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(VOCAB)]
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for _ in range(docs):
            w, text = rng.randrange(VOCAB), []
            for _ in range(words_per_doc):
                text.append(words[w])
                w = rng.choice(successors[w])
            f.write(json.dumps({"text": " ".join(text)}) + "\n")
    return tok_dir, data_dir


def _write_tokenizer(tok_dir: str, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {UNK: 0, BOS: 1, EOS: 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([BOS, EOS])
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False,
                   "model_max_length": 1 << 20}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--docs", type=int, default=2000)
    args = p.parse_args(argv)
    tok_dir, data_dir = write_debug_assets(args.out_dir, docs=args.docs)
    print(f"--model.hf_assets_path {tok_dir} --training.dataset_path {data_dir}")


if __name__ == "__main__":
    main()
