"""The measurement loop: `plan` expands a campaign's grid into cells, `runner` sets each
cell's knobs and decodes while `sampler` reads power and energy in the background, `meter`
turns the samples and rounds into a cell's statistics, and `journal` appends each cell as a
JSON line (in the `dvfs.records` format) so a sweep can resume.

Nothing is re-exported here: a caller imports the one module it needs, so the CLI's progress
bar can name a `Cell` without loading the runner's engines and GPUs, and `dvfs.records`
(which names `plan`'s cells and `meter`'s measurements) sits below `journal` with no loop
through this package.
"""
