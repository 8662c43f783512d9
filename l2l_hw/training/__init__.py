"""The training loop's components; l2l_hw/train.py composes them into train().

    config.py       TrainConfig (every component's options, flat), ConfigError
    components.py   the EPS, the relay or pipeline stage, the device share's plan, built from a config
    data.py         the reference corpus's training and validation windows
    state.py        TrainState (a run between steps), TrainResult
    files.py        the run's files in out: names, check_out, prepare_out
    checkpoints.py  save, restore, resume (the config checked against the checkpoint's)
    evaluation.py   validation into a step's metrics row
    metrics.py      metrics.jsonl, TensorBoard, the progress bar, loss.png
    signals.py      SIGINT / SIGTERM: a stop at a step boundary on every rank
    report.py       the banner, the recompute plan, the end lines
"""
