"""Fake mode's engine: the fake tensor mode, the device guard that lets torch make fake CUDA tensors without a GPU, the
simulated backward pass, and the spoofed GPU that ``torch.cuda`` describes inside fake blocks."""
