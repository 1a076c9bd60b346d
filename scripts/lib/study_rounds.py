"""The records of a measure script's rounds (runs.jsonl in a results folder), grouped by the study
name less its round suffix ("zero3-prefetch-on-2" -> "zero3-prefetch-on"), in the order the runs
first appear. Imported by the scripts' table-making Python, run from the repository's root."""
import collections
import json


def by_study(results_dir):
    groups = collections.defaultdict(list)
    with open(results_dir + "/runs.jsonl") as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                groups[record["study"].rsplit("-", 1)[0]].append(record)
    return groups
