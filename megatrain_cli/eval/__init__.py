"""Exact-match eval: what `megatrain eval` runs (`settings`: the recipe's keys, the measurement options),
the protocol (`protocol`: few-shot, prompt, answer extraction and scoring), greedy generation (`generate`:
resident; `streamed` + `layer_feed`: layers streamed from host memory), the model to run and how
(`source`), and the eval run (`run`).

`run` imports torch and transformers; `settings` imports neither, so the CLI reads it at start.
"""
