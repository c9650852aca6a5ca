"""Make the demo model that ships in the package: a small tokenizer and a chat template (``kvrouter/chat/demo_model``).

    python tools/make_demo_model.py [--vocab 2048] [--out kvrouter/chat/demo_model]

``kvrouter up``'s demo fleet serves chat with no ``--model-path``, so the package needs a tokenizer and a
template of its own, made from text it may ship: this repository's own docs (``README.md`` and ``docs/``).
A byte-level BPE (``tokenizers``), so any text encodes, with ChatML's special tokens, trained on those
files in sorted order; ``tokenizer_config.json`` holds the ChatML template and the special tokens, and
``config.json`` the context limit (32,768 tokens). About a hundred kB in all.

Run it again only to change the model: the demo, its tests and every recorded figure use the files as
committed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
SPECIAL: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen's and many others' templates write it."""
CONTEXT: Final = 32768


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size (default: 2048)")
    parser.add_argument("--out", type=Path, default=ROOT / "kvrouter" / "chat" / "demo_model", help="where to write")
    args = parser.parse_args(argv)
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(path) for path in texts], trainer)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": CONTEXT,
        "chat_template": TEMPLATE,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (args.out / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}, indent=2) + "\n")
    size = sum(path.stat().st_size for path in args.out.iterdir())
    print(f"wrote {args.out} ({size:,} bytes; trained on {len(texts)} files, vocabulary {tokenizer.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
