"""The artifact cache: what the compile stages made for a graph, kept on disk for later processes.

``artifacts`` keys and stores entries and wraps the stage list of :mod:`fusec.pipeline` once
(:func:`~fusec.cache.artifacts.compile_graph`); ``entry_codec`` turns an entry into plain data
and back. It imports nothing of :mod:`fusec.runtime`, which loads and launches what it returns.
"""
