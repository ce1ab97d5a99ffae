"""Plans: per op the chosen library, config and precision, made from records; a library's plan
variants; running a plan (``kselect.load_plan``); the spinning plan-level dim."""
