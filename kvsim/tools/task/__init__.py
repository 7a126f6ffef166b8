"""``kvsim task``: the passkey task inside a real model, beside the simulator's prediction."""
