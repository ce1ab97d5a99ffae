"""``kselect report``: one self-contained HTML page about a plan, with its charts."""
