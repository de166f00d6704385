"""Every `auto` of a trial, resolved once before training: the memory plan (`memory_plan`, on the CPU or a GPU
`target`), the budget and `strategy: auto` (`budget`), what the trial decides from them (`preflight`), the
micro-batch and learning rate (`training`: the frozen `ResolvedTraining`), and the plan stage's report."""
