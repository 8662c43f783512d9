"""The GPU campaign (`l2l bench gpu`; docs/GPU_CAMPAIGN.md): the relay against each regime's strongest
peers, under one memory cap.

    campaign.py   the command: its parts, sizes, limits and summary.json (add_arguments, run_from_args)
    regimes.py    the three regimes: sizes, grids, runs and checks of every side
    peers.py      the peers' knobs, grids, DeepSpeed / FSDP2 configs and memory estimators
    sides.py      one process per side, serving load / steps / unload requests
    partners.py   the relay's PyTorch partners on the reference GPT
    capacity.py   the largest GPT each side trains under the cap, probed one process at a time
    llama.py      the Llama-3-8B-shaped folders and `l2l finetune` runs on them
    extras.py     the first campaign's parts: memory by depth, trace, syncs, eps, overlap
    checks.py     the checks that can fail: finite figures, the loss bound, run order, time limits
    figures.py    model FLOPs, dense bf16 peaks, MFU, spreads
    watch.py      a watched subprocess: its rows, peak RSS, GPU idle share
    wheels.py     `python -m l2l_hw.bench.gpu.wheels`: the wheels the peers need on the lent machine

Nothing is imported here: `python -m l2l_hw.bench.gpu.sides` (and .capacity, .wheels) runs a
module of this package as a process of its own, which imports the package first.
"""
