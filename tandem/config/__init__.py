"""Config classes of every process (the single source of defaults), TOML reading and the RL config's resolution."""
