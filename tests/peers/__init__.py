"""Properties from peer projects' optimizer test suites, restated for AdamBridge (its own package
so that its module names cannot collide with those of tests/)."""
