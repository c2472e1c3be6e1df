"""adambridge-lab: the local page, its runs, and the report format every benchmark writes.

The demo (``python -m adambridge demo``) lives here too: it is one of the lab's phases.
"""
