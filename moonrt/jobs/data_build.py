"""``moonrt data build``: text tokenized with a model's tokenizer into a Megatron indexed dataset.

``moonrt data build --tokenizer tok.json --input a.txt b.jsonl --output data/corpus`` writes ``data/corpus.bin`` and
``data/corpus.idx`` (:mod:`moonrt.jobs.train.indexed`), one document per text file and per ``.jsonl`` line
(:mod:`moonrt.jobs.train.tokenized`), for ``moonrt train --corpus data/corpus`` or a ``data.blend`` entry. Both
files are created exclusively (an existing one is never overwritten) and atomically. Exit 2 with one line on bad
input.
"""

from __future__ import annotations

import argparse
import sys

from moonrt.jobs.train import indexed, tokenized
from moonrt.jobs.train.data import _not_a_corpus_file
from moonrt.jobs.train.tokenizer import load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="tokenize text into PREFIX.bin/.idx (Megatron's indexed dataset)")
    build.add_argument("--tokenizer", required=True, metavar="PATH",
                       help="a Hugging Face tokenizer.json or tiktoken BPE file (read from disk)")
    build.add_argument("--input", required=True, nargs="+", metavar="FILE",
                       help="text files (one document each) or .jsonl files (one document per line's 'text')")
    build.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx (new)")


def run(args: argparse.Namespace) -> int:
    try:
        for path in args.input:
            if (what := _not_a_corpus_file(path)) is not None:
                raise ValueError(f"--input {path!r}: {what}; expected an existing text or .jsonl file")
        for p in indexed.paths(args.output):
            if p.exists() or p.is_symlink():
                raise ValueError(f"--output {args.output!r}: {str(p)!r} exists; expected a new prefix (nothing is "
                                 "overwritten)")
        tok = load_tokenizer(args.tokenizer)
        docs, tokens = tokenized.build(tok, args.input, args.output)
    except FileNotFoundError as exc:
        print(f"moonrt data: error: --output {args.output!r}: {exc.strerror} ({exc.filename})", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"moonrt data: error: {exc}", file=sys.stderr)
        return 2
    print(f"moonrt data: wrote {args.output}.bin/.idx: {docs} documents, {tokens:,} tokens "
          f"({indexed.dtype_for(tok.vocab_size)}, vocabulary {tok.vocab_size})")
    return 0
