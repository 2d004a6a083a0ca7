"""Training: the StarPO loop (RL). SFT, checkpoints and distributed glue plug in here."""
