"""Planning across libraries: the per-node problem (options and conversion costs), its exact
solver, turning a labelling into a plan, and the conversions and switch costs it charges."""
