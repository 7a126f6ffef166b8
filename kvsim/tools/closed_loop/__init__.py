"""The closed loop: kvsim's policies inside a real model, against the simulator's open-loop mass."""
