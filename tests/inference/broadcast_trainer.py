"""The trainer's end of a broadcast test, in its own process: send model folders' weights as policies,
one after the other, without waiting for the servers in between.

Usage: python broadcast_trainer.py RUN_DIR PORT NUM_INFERENCE_RANKS STEP MODEL_FOLDER [STEP MODEL_FOLDER ...]
"""

import sys
from pathlib import Path

import torch

from tandem.config.weight_transport import BroadcastWeightTransport
from tandem.models.weights import load_state_dict
from tandem.trainer.broadcast_publish import WeightBroadcaster

def main(run_dir: str, port: str, num_ranks: str, *policies: str) -> None:
    """A function, so that the group is freed when it returns, not at interpreter exit (`close_group`)."""
    # A small bucket threshold, so that the tiny model crosses the group in several buckets.
    config = BroadcastWeightTransport(port=int(port), num_inference_ranks=int(num_ranks), bucket_mib=0.25, timeout_s=60)
    sender = WeightBroadcaster(Path(run_dir), config, torch.device("cpu"))
    for step, folder in zip(policies[::2], policies[1::2]):
        sender.send(int(step), load_state_dict(Path(folder)))
    sender.close()
    print("sent", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
