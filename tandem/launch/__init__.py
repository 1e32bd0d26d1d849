"""The launcher of `tandem rl`: resolves one config into the three processes, starts and watches them locally or on
several nodes, and renders Slurm scripts and Kubernetes manifests."""
