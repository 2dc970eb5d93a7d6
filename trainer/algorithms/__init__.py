"""The trainer's math: advantage estimators, policy and value losses, KL estimators, aggregations, preference losses."""
