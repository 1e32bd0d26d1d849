"""`tandem model ...`: tools for model folders."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

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
    init.add_argument("--draft-head", action="store_true",
                      help="With a draft head (a multi-token prediction layer for `engine.speculative.method = \"mtp\"`).")
    head = sub.add_parser("add-draft-head", help="Write a copy of a model folder with a draft head (a multi-token "
                          "prediction layer, initialized from the last block) for speculative decoding.")
    head.add_argument("src", help="Model folder (Qwen3, Qwen3-MoE, MiniMax-M2) or hub name.")
    head.add_argument("dst", help="Folder to write (created if missing).")
    export = sub.add_parser("export", help="Write a standalone model folder from a run's published policy (`weights/step_N`).")
    export.add_argument("folder", help="A published policy folder: full weights, or LoRA adapters (with --merge).")
    export.add_argument("--out", required=True, help="Folder to write (created if missing).")
    export.add_argument("--merge", action="store_true", help="Merge LoRA adapters into their base model.")
    export.add_argument("--base", default=None,
                        help="With --merge: the base model (default: the adapters' `base_model_name_or_path`).")
    args = parser.parse_args(argv)
    if args.action == "export":
        return export_folder(args.folder, args.out, args.merge, args.base)
    if args.action == "add-draft-head":
        from tandem.models.draft_head import add_draft_head

        try:
            out = add_draft_head(args.src, Path(args.dst))
        except (ValueError, FileNotFoundError) as err:
            print(f"tandem model add-draft-head: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.src} with a draft head to {out}", file=sys.stderr)
        return 0
    from tandem.models.presets import init_model

    out = init_model(args.preset, args.out, args.seed, num_layers=args.num_layers, weights=not args.config_only,
                     max_position_embeddings=args.max_position_embeddings, draft_head=args.draft_head)
    print(f"wrote {args.preset} model{' config' if args.config_only else ''} to {out}", file=sys.stderr)
    return 0


def export_folder(folder: str, out: str, merge: bool, base: str | None) -> int:
    from tandem.models.lora import export_merged, is_adapter_folder
    from tandem.models.weights import side_files, weight_files

    source = Path(folder)
    if not source.is_dir():
        print(f"tandem model export: {folder} is no folder", file=sys.stderr)
        return 2
    adapters = is_adapter_folder(source)
    if adapters != merge:
        holds = ("LoRA adapters: pass --merge to merge them into their base" if adapters else
                 "full weights: --merge is for LoRA adapter folders")
        print(f"tandem model export: {folder} holds {holds}", file=sys.stderr)
        return 2
    target = Path(out)
    if adapters:
        export_merged(source, target, base)
    else:
        target.mkdir(parents=True, exist_ok=True)
        for src in [*weight_files(source), *source.glob("*.safetensors.index.json"), *side_files(source)]:
            shutil.copyfile(src, target / src.name)
    print(f"wrote {'merged ' if adapters else ''}model to {target}", file=sys.stderr)
    return 0
