"""The tables `python -m evaluation` prints: per source, loss by position, passkey, tasks."""
import math


def _f(value, digits: int = 4) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def format_report(results: dict) -> str:
    lines = [f"checkpoint {results['checkpoint']} (step {results.get('step', '?')}): model {results['model']}, "
             f"data {results['data']}, seq_len {results['seq_len']}"]
    data = results.get("data_eval")
    if data:
        sources = {**data["sources"], "all": data["all"]}
        if "bits_per_byte" in data["all"]:  # a per-token NLL (evaluation/sources.py)
            lines += ["", f"{'source':<16} {'tokens':>9} {'loss':>7} {'ppl':>9} {'bits/byte':>9} "
                          f"{'unigram bpb':>11} {'unigram loss':>12}"]
            for name, r in sources.items():
                lines.append(f"{name:<16} {r['tokens']:>9,} {_f(r['loss']):>7} {_f(r['ppl'], 2):>9} "
                             f"{_f(r['bits_per_byte']):>9} {_f(r['unigram_bits_per_byte']):>11} "
                             f"{_f(r['unigram_loss']):>12}")
            lengths = data["context_lengths"]
            lines += ["", f"loss by position in the row (buckets of {data['position_bucket']} target positions; "
                          "all sources)"]
            for length, entry in lengths.items():
                if "skipped" in entry:
                    lines.append(f"  seq_len {length:>5}: skipped ({entry['skipped']})")
                    continue
                lines.append(f"  seq_len {length:>5} ({entry['rows']} rows, loss {_f(entry['loss'])}): " +
                             "  ".join(f"{b['start']}-{b['end']} {_f(b['loss'])}" for b in entry["all"]))
            per_source = [(name, r["by_position"]) for name, r in data["sources"].items()]
            for name, buckets in per_source:
                lines.append(f"  {name:<14} " + "  ".join(f"{b['start']}-{b['end']} {_f(b['loss'])}" for b in buckets))
        else:
            metrics = [k for k in data["all"] if k not in ("masked_tokens", "unigram_top1_token")]
            lines += ["", f"{'source':<16} " + " ".join(f"{k:>{max(len(k), 8)}}" for k in metrics)]
            for name, r in sources.items():
                lines.append(f"{name:<16} " + " ".join(f"{_f(r.get(k)):>{max(len(k), 8)}}" for k in metrics))
    passkey = results.get("passkey")
    if passkey:
        depths = list(next(iter(passkey.values())))
        lines += ["", "passkey accuracy (10 candidate keys, chance 0.10) by length and depth",
                  f"{'length':>8} " + " ".join(f"{'depth ' + d:>10}" for d in depths)]
        for length, by_depth in passkey.items():
            lines.append(f"{length:>8} " + " ".join(f"{by_depth[d]:>10.2f}" for d in depths))
    tasks = results.get("tasks") or {}
    if tasks:
        lines += ["", f"{'task':<18} {'kind':<15} {'n':>5} {'acc':>7} {'acc_norm':>8} {'chance':>7} "
                      f"{'exact':>7} {'rouge_l':>7}"]
        for name, r in tasks.items():
            if "skipped" in r:
                lines.append(f"{name:<18} {r['kind']:<15} {r['n']:>5}  skipped: {r['skipped']}")
                continue
            lines.append(f"{name:<18} {r['kind']:<15} {r['n']:>5} {_f(r.get('acc')):>7} {_f(r.get('acc_norm')):>8} "
                         f"{_f(r.get('chance')):>7} {_f(r.get('exact_match')):>7} {_f(r.get('rouge_l')):>7}")
    return "\n".join(lines)
