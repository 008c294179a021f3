"""Corpora: `data prepare`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from reslab.models.config import ConfigError, to_dict
from reslab.orchestrator.cli.args import output_dir, positive_float, positive_int


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from reslab.models.data import corpus_path
    from reslab.models.data.prepare import SHARD_TOKENS
    from reslab.orchestrator.driving.dataprep import PrepareRequest, prepare_corpus

    if (args.out is None) == (args.corpus is None):
        raise ConfigError("data prepare: give exactly one of --out DIR and --corpus NAME")
    if args.corpus is not None and corpus_path(args.corpus).parent.name != "corpora":
        raise ConfigError(f"--corpus: {args.corpus!r} is not a corpus name (letters, digits, _ . -); "
                          "use --out for a path")
    out = args.out if args.out is not None else corpus_path(args.corpus)
    request = PrepareRequest(
        inputs=args.inputs, fmt=args.format, out_dir=out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        tokenizer_path=args.tokenizer_path,
        text_field=args.text_field, val_fraction=args.val_fraction, hub=args.hub, hub_name=args.name,
        split=args.split, revision=args.revision, id_field=args.id_field,
        max_tokens=None if args.tokens is None else int(args.tokens), bpe_docs=args.bpe_docs,
        shard_tokens=args.shard_tokens or SHARD_TOKENS,
    )
    last = [time.monotonic()]

    def progress(n_docs: int, n_tokens: int) -> None:
        if time.monotonic() - last[0] >= 30:
            last[0] = time.monotonic()
            print(f"data prepare: {n_docs:,} documents, {n_tokens:,} train tokens", file=sys.stderr, flush=True)

    try:
        meta = prepare_corpus(request, progress)
    except ValueError as exc:  # bad inputs (too few documents, a missing field): a usage error
        raise ConfigError(f"data prepare: {exc}") from None
    print(json.dumps(to_dict(meta), indent=2, default=str))
    print(f"prepared {out}: use it as data.corpus: {args.corpus or out}", file=sys.stderr)
    return 0



def register(sub: Any) -> None:
    data = sub.add_parser("data", help="prepare corpora").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("prepare", help="tokenise text/JSONL/Parquet files or a Hugging Face dataset into "
                                          "memory-mapped shards with a manifest")
    p.add_argument("inputs", nargs="*", help="files or directories (none with --hub)")
    p.add_argument("--format", choices=["text", "jsonl", "parquet"], default="text",
                   help="text: one document per file (default); jsonl, parquet: one per record, its --text-field")
    p.add_argument("--hub", metavar="DATASET",
                   help="stream a Hugging Face dataset instead (e.g. HuggingFaceFW/fineweb-edu), or a local folder in "
                        "the hub's layout; needs `pip install 'reslab[hub]'`")
    p.add_argument("--name", help="the --hub dataset's config (e.g. sample-10BT)")
    p.add_argument("--split", default="train", help="the --hub dataset's split (default train)")
    p.add_argument("--revision", help="the --hub dataset's commit, tag or branch (default: main; the resolved "
                                      "commit is recorded in the manifest)")
    p.add_argument("--id-field", default="id", help="the --hub column with a stable document id (default id; "
                                                     "rows without one are named by split and row)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet or hub column holding the text")
    p.add_argument("--tokens", type=positive_float, metavar="N",
                   help="train token budget, e.g. 3e9: stop reading once the train split holds N tokens")
    p.add_argument("--tokenizer", choices=["byte", "bpe", "hf"], default="byte",
                   help="hf: a checkpoint's own tokenizer (--tokenizer-path; transformers, the eval extra)")
    p.add_argument("--tokenizer-path", metavar="DIR", help="--tokenizer hf: the checkpoint directory (its "
                                                            "tokenizer files, read by transformers.AutoTokenizer)")
    p.add_argument("--vocab-size", type=positive_int, default=4096, help="BPE vocabulary size")
    p.add_argument("--bpe-docs", type=positive_int, metavar="N",
                   help="train the BPE on the first N documents (default: all; required with --hub)")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--shard-tokens", type=positive_int, help="tokens per shard file (default 2^28 = 268,435,456)")
    p.add_argument("--out", type=output_dir, help="output directory (use its path as data.corpus)")
    p.add_argument("--corpus", metavar="NAME",
                   help="write into the cache as $RESLAB_CACHE/corpora/NAME (use NAME as data.corpus)")
    p.set_defaults(func=cmd_data_prepare)
