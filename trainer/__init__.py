"""Trainer: samples from recorded calls, RL losses, policy updates, engine control. No Django here."""
