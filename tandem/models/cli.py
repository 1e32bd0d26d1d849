"""`tandem model ...`: tools for model folders."""

from __future__ import annotations

import argparse
import sys

from tandem.models.presets import PRESETS


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem model", description="Model folder tools.")
    sub = parser.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="Write a model folder of a native family with random weights and a byte tokenizer.")
    init.add_argument("--preset", choices=list(PRESETS), default="tiny")
    init.add_argument("--out", required=True, help="Folder to write (created if missing).")
    init.add_argument("--seed", type=int, default=0, help="Seed of the random weights.")
    init.add_argument("--num-layers", type=int, default=None, help="Keep only the first K blocks of the preset.")
    init.add_argument("--max-position-embeddings", type=int, default=None,
                      help="Context length; past the preset's, RoPE is extended by YaRN (factor = new / preset's).")
    init.add_argument("--config-only", action="store_true",
                      help="Write config, generation config and tokenizer, no weights (for real shapes built on the device).")
    args = parser.parse_args(argv)
    from tandem.models.presets import init_model

    out = init_model(args.preset, args.out, args.seed, num_layers=args.num_layers, weights=not args.config_only,
                     max_position_embeddings=args.max_position_embeddings)
    print(f"wrote {args.preset} model{' config' if args.config_only else ''} to {out}", file=sys.stderr)
    return 0
