"""`dvfs gpu roofline`: measure the GPU's own roofline, power and energy per FLOP and per byte at
each SM clock, with torch microbenchmarks (`kernels`), under the sweep's safety layer (`run`),
into a small netCDF file (`store`). Nothing is re-exported: importing this package must not
import torch, which is an optional extra.
"""
