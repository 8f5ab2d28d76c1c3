"""Slurm, one module per job: render the sbatch script (``script``), submit it (``executor``), follow it to the
end (``watch``), and what runs inside the job (``task``: each rank of a submitted training job; ``prepare``: the
config of a plain ``sbatch slurm/train.sbatch``). None of it imports torch.
"""
