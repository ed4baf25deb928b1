"""Exact-match eval: answer extraction and scoring (`extract`), greedy generation and the eval run (`run`).

`run` imports torch and transformers; `extract` is plain Python so the data path can use it freely.
"""
