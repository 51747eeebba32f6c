"""Platform selection (CUDA+NCCL+TE vs CPU+gloo+local) and the CPU compatibility layer."""
