"""Training a model: the run's config (`config`), the trainer and evaluation (`trainer`), the
optimizer's schedule (`optim`), metrics and their files (`metrics`), and the guards that keep a
run alive or stop it cleanly (`faults`)."""
