# The compiled kernels (csrc/): loading the module registers them with torch's dispatcher
# under the amp_patch namespace; it has no Python names of its own.
