"""`python -m looptrain.cli.finetune`: the console script `looptrain-finetune`."""

from looptrain.cli.finetune import main_entry

main_entry()
