"""evalkit inside other tools.

lm_eval.py          the `evalkit` model for lm-evaluation-harness (importing it registers `--model evalkit`)
lm_eval_options.py  its model args, checked up front, and lm-eval command lines with the model implied
lm_eval_command.py  `evalkit lm-eval`: lm-eval's CLI, each evaluation saved to runs/<run_id>/
wandb.py            the W&B mirror of runs and sweeps (offline unless credentials and a route exist)
"""
