"""The measurement loop: `plan` expands a campaign's grid into cells, `runner` sets each
cell's knobs and decodes while `sampler` reads power and energy in the background, `meter`
turns the samples and rounds into a cell's statistics, and `journal` appends each cell as a
JSON line (in the `dvfs.records` format) so a sweep can resume.

Nothing is re-exported here: `dvfs.records` imports `plan` and `meter`, and the journal
imports `dvfs.records`, so the package stays a plain folder to keep that chain acyclic.
"""
