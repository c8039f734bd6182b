"""Executors: how a Fleet whose kind is not ``node`` reaches the engine that runs its Jobs
(``slurm/``: an existing Slurm cluster through slurmrestd). Each is chosen by the Fleet's kind,
never as a fallback for another."""
