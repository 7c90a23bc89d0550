"""The experiment apparatus, apart from the library: the offline zoo, `featcal bench`, the paper's
reproduction pipelines, evaluation, and the post-merge baselines Surgery / ProbSurgery."""
