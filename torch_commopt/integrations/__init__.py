"""Recipes that switch commopt on from another framework's own configuration.

    torchtitan/   torchtitan 0.2.2: a `[commopt]` job-config section and the train spec
                  "llama3_commopt" (see torch_commopt.integrations.torchtitan)

Nothing here is imported by `import torch_commopt`; each recipe imports its framework only
when it is used, so the package imports without any of them installed.
"""
