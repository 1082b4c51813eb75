"""The building blocks the modes compose: sharded linear pieces and their collectives (`layers`),
the vocabulary-parallel cross-entropy (`loss`), SUMMA's 2D products (`summa`) and the 3D cube's
(`cube`)."""
