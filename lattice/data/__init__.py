"""What the model reads: the built-in corpus, the user's files and tokenizers, per-rank batches
(`corpus`), and the tasks that turn text into inputs and targets (`tasks`: next token, masked
LM, classification; `seq2seq`: source/target pairs)."""
