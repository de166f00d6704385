"""The tasks by name: one line each, `name -> "module:Class"`. Adding a task is its file in tasks/ and a line here.

Light on purpose (no torch): the params schema takes its allowed `task` values from here, and
`pipelines.tasks.get_task` imports a task's module only when it is asked for.
"""

TASKS: dict[str, str] = {
    "classification": "pipelines.tasks.classification:ClassificationTask",
    "causal_lm": "pipelines.tasks.causal_lm:CausalLmTask",
    "seq2seq": "pipelines.tasks.seq2seq:Seq2SeqTask",
}
