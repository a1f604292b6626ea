"""GPU schedules of the commopt ops: symmetric memory + copy engines + Triton/cuBLAS.

Imported lazily by `torch_commopt.kernels.matmul.ops` the first time an op runs on a CUDA tensor
with a GPU schedule, so importing the package never touches CUDA.
"""
