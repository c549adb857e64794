"""Image inputs: loading (media.py), preprocessing into placeholder tokens and features
(processor.py), the features a request carries to the core (inputs.py) and what a family
declares about its images (spec.py). No torch at import: the control plane reads inputs.py."""
