"""The tool's release version, in a leaf module so anything may import it without a cycle.

(The journal's and the cube's format versions are `dvfs.records.JOURNAL_SCHEMA` and
`dvfs.cube.CUBE_SCHEMA`; this one is the package's.)
"""

__version__ = "0.1.0"
