"""The trainer's end of a broadcast test, in its own process: send model folders' weights as policies,
one after the other, without waiting for the servers in between.

Usage: python broadcast_trainer.py [--fp8] RUN_DIR PORT NUM_INFERENCE_RANKS STEP MODEL_FOLDER [STEP MODEL_FOLDER ...]
(`--fp8`: `weight_transport.quantization = "fp8"`, the projections named from the first folder's model). Prints
the bytes each policy took on the wire, then "sent".
"""

import sys
from pathlib import Path

import torch

from tandem.config.weight_transport import BroadcastWeightTransport
from tandem.models.fp8 import fp8_weight_names
from tandem.models.hub import read_hf_config
from tandem.models.loading import build_native
from tandem.models.weights import load_state_dict
from tandem.trainer.broadcast_publish import WeightBroadcaster


def main(*args: str) -> None:
    """A function, so that the group is freed when it returns, not at interpreter exit (`close_group`)."""
    fp8 = args[0] == "--fp8"
    run_dir, port, num_ranks, *policies = args[1:] if fp8 else args
    # A small bucket threshold, so that the tiny model crosses the group in several buckets.
    config = BroadcastWeightTransport(port=int(port), num_inference_ranks=int(num_ranks), bucket_mib=0.25, timeout_s=60,
                                      quantization="fp8" if fp8 else "none")
    model = build_native(read_hf_config(Path(policies[1])), "meta", torch.bfloat16)
    names = fp8_weight_names(model, config.fp8_experts) if fp8 else ()
    sender = WeightBroadcaster(Path(run_dir), config, torch.device("cpu"), names)
    for step, folder in zip(policies[::2], policies[1::2]):
        print(f"step {step}: {sender.send(int(step), load_state_dict(Path(folder)))} bytes", flush=True)
    sender.close()
    print("sent", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
