"""Exact-match eval: answer extraction and scoring (`extract`), greedy generation (`generate`: resident;
`streamed` + `layer_feed`: layers streamed from host memory), the model to run and how (`source`), and
the eval run (`run`).

`run` imports torch and transformers; `extract` is plain Python so the data path can use it freely.
"""
