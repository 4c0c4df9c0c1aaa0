// Native core of tailrl.speculative.sources.suffix_index: the same occurrence index as the Python
// reference (PySuffixIndex in suffix_index.py), token for token, about 20x cheaper.
//
// Keys of k tokens are identified by a 64-bit polynomial hash of the k tokens (prefix
// hashes per sequence, so a key costs O(1) per appended token); every lookup compares the
// tokens themselves, so a hash collision can never change a result, only cost a comparison.
// Per key hash, occurrences are kept in insertion order, like the Python table's lists: each
// key length's table is flat (an open-addressing map from a key's hash to its latest occurrence,
// each occurrence linking to the one before it, all in one array), so an index is a handful
// of allocations however many tokens it holds, and freeing it costs microseconds, not one
// free per distinct key (a request's index is dropped the moment it finishes).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr uint64_t kBase = 0x9E3779B97F4A7C15ULL;  // odd multiplier; arithmetic is mod 2^64

struct Occ {
  int32_t seq;
  int32_t pos;  // the position that follows the key's k tokens
};

// One key length's occurrences: a key hash's occurrences are a list linked from its most
// recent (``latest``) through ``prev``, newest first; the map is open addressing with linear
// probing, at most half full.
class Table {
 public:
  Table() : hashes_(16), latest_(16, -1) {}

  void add(uint64_t h, Occ o) {
    if (2 * (used_ + 1) > latest_.size()) grow();
    size_t s = slot(h, latest_.size());
    while (latest_[s] >= 0 && hashes_[s] != h) s = (s + 1) & (latest_.size() - 1);
    if (latest_[s] < 0) {
      hashes_[s] = h;
      ++used_;
    }
    if (occ_.size() >= static_cast<size_t>(INT32_MAX)) throw std::length_error("suffix index: too many occurrences");
    occ_.push_back(o);
    prev_.push_back(latest_[s]);
    latest_[s] = static_cast<int32_t>(occ_.size() - 1);
  }

  // the latest occurrence of key hash h, or -1; ``prev(i)`` the one before occurrence i
  int32_t latest(uint64_t h) const {
    for (size_t s = slot(h, latest_.size());; s = (s + 1) & (latest_.size() - 1)) {
      if (latest_[s] < 0) return -1;
      if (hashes_[s] == h) return latest_[s];
    }
  }
  int32_t prev(int32_t i) const { return prev_[i]; }
  const Occ& at(int32_t i) const { return occ_[i]; }

 private:
  static size_t slot(uint64_t h, size_t size) {
    h ^= h >> 31;                          // the polynomial hash's low bits mix poorly: finish it
    h *= 0xBF58476D1CE4E5B9ULL;
    return static_cast<size_t>(h >> 32) & (size - 1);
  }

  void grow() {
    std::vector<uint64_t> hashes(2 * latest_.size());
    std::vector<int32_t> latest(2 * latest_.size(), -1);
    for (size_t s = 0; s < latest_.size(); ++s) {
      if (latest_[s] < 0) continue;
      size_t t = slot(hashes_[s], latest.size());
      while (latest[t] >= 0) t = (t + 1) & (latest.size() - 1);
      hashes[t] = hashes_[s];
      latest[t] = latest_[s];
    }
    hashes_.swap(hashes);
    latest_.swap(latest);
  }

  std::vector<uint64_t> hashes_;
  std::vector<int32_t> latest_;           // -1: an empty slot
  size_t used_ = 0;
  std::vector<Occ> occ_;
  std::vector<int32_t> prev_;
};

struct Heads {  // one heap entry of the tree search
  double neg_path;
  int64_t tie;
  int32_t token;
  double prob;
  int32_t parent;
  std::vector<Occ> occ;
};

struct HeadsOrder {  // std::priority_queue is a max-heap: invert to pop the smallest
  bool operator()(const Heads* a, const Heads* b) const {
    if (a->neg_path != b->neg_path) return a->neg_path > b->neg_path;
    return a->tie > b->tie;
  }
};

class Index {
 public:
  Index(std::vector<int> keys, int min_match_len, int max_match_len, int64_t max_occurrences)
      : keys_(std::move(keys)), min_len_(min_match_len), max_len_(max_match_len),
        max_occ_(max_occurrences), tables_(keys_.size()) {
    int longest = keys_.empty() ? 0 : *std::max_element(keys_.begin(), keys_.end());
    pow_.assign(longest + 1, 1);
    for (int i = 1; i <= longest; ++i) pow_[i] = pow_[i - 1] * kBase;
  }

  int add(const std::vector<int32_t>& tokens) {
    int sid = static_cast<int>(seqs_.size());
    seqs_.emplace_back();
    prefix_.emplace_back(1, 0);
    extend(sid, tokens);
    return sid;
  }

  void extend(int sid, const std::vector<int32_t>& tokens) {
    check(sid);
    auto& seq = seqs_[sid];
    auto& h = prefix_[sid];
    size_t old = seq.size();
    for (int32_t t : tokens) {
      seq.push_back(t);
      h.push_back(h.back() * kBase + static_cast<uint64_t>(static_cast<uint32_t>(t)) + 1);
    }
    size_t now = seq.size();
    for (size_t i = 0; i < keys_.size(); ++i) {
      size_t k = keys_[i];
      for (size_t n = std::max(old + 1, k); n <= now; ++n)
        tables_[i].add(hash(h, n - k, n), {sid, static_cast<int32_t>(n)});
    }
    num_tokens_ += static_cast<int64_t>(now - old);
  }

  std::vector<int32_t> tokens(int sid) const {
    check(sid);
    return seqs_[sid];
  }

  size_t size() const { return seqs_.size(); }
  int64_t num_tokens() const { return num_tokens_; }

  // (m, occurrences): see PySuffixIndex.match
  std::pair<int, std::vector<Occ>> match(const std::vector<int32_t>& ctx, int exclude) const {
    return match(ctx.data(), static_cast<int>(ctx.size()), exclude);
  }

  std::pair<int, std::vector<Occ>> match(const int32_t* ctx, int n, int exclude) const {
    const int hi = std::min(max_len_, n);
    int cap = hi;
    for (int i = static_cast<int>(keys_.size()) - 1; i >= 0; --i) {
      const int k = keys_[i];
      if (k > hi) continue;
      uint64_t hc = 0;                     // the key hash of the context's last k tokens
      for (int j = n - k; j < n; ++j) hc = hc * kBase + static_cast<uint64_t>(static_cast<uint32_t>(ctx[j])) + 1;
      const Table& table = tables_[i];
      int32_t at = table.latest(hc);
      if (at >= 0) {
        // the most recent max_occ_ occurrences whose k tokens equal the context's tail
        std::vector<Occ> recent;
        for (; at >= 0 && static_cast<int64_t>(recent.size()) < max_occ_; at = table.prev(at))
          if (same_tail(table.at(at), k, ctx, n)) recent.push_back(table.at(at));
        std::reverse(recent.begin(), recent.end());
        int best = 0;
        std::vector<Occ> cands;
        for (const Occ& o : recent) {
          const auto& seq = seqs_[o.seq];
          if (o.seq == exclude || o.pos >= static_cast<int32_t>(seq.size())) continue;
          int m = k;
          while (m < cap && m < o.pos && seq[o.pos - 1 - m] == ctx[n - 1 - m]) ++m;
          if (m > best) {
            best = m;
            cands.assign(1, o);
          } else if (m == best) {
            cands.push_back(o);
          }
        }
        if (!cands.empty()) return {best, cands};
      }
      cap = k - 1;
    }
    return {0, {}};
  }

  py::tuple py_match(const std::vector<int32_t>& ctx, int exclude) const {
    auto r = match(ctx, exclude);
    py::list occ;
    for (const Occ& o : r.second) occ.append(py::make_tuple(o.seq, o.pos));
    return py::make_tuple(r.first, occ);
  }

  std::map<int32_t, int64_t> continuations(const std::vector<int32_t>& ctx, int exclude) const {
    std::map<int32_t, int64_t> counts;
    for (const Occ& o : match(ctx, exclude).second) {
      const auto& seq = seqs_[o.seq];
      if (o.pos < static_cast<int32_t>(seq.size())) counts[seq[o.pos]] += 1;
    }
    return counts;
  }

  // None, or (tokens, parents, probs, match_len): see PySuffixIndex.propose
  py::object propose(const std::vector<int32_t>& ctx, int max_tokens, int max_paths, double min_token_prob,
                     double tokens_per_match, int exclude) const {
    return propose_at(ctx.data(), static_cast<int>(ctx.size()), max_tokens, max_paths, min_token_prob,
                      tokens_per_match, exclude);
  }

  // ``propose`` of the context ctx[0 .. n)
  py::object propose_at(const int32_t* ctx, int n, int max_tokens, int max_paths, double min_token_prob,
                        double tokens_per_match, int exclude) const {
    if (max_tokens <= 0) return py::none();
    auto r = match(ctx, n, exclude);
    const int m = r.first;
    if (m == 0) return py::none();
    if (tokens_per_match > 0)
      max_tokens = std::min<int64_t>(max_tokens, static_cast<int64_t>(std::ceil(tokens_per_match * m)));
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;
    if (max_paths == 1)
      chain(r.second, max_tokens, min_token_prob, tokens, probs);
    else
      tree(r.second, max_tokens, max_paths, min_token_prob, tokens, parents, probs);
    if (tokens.empty()) return py::none();
    if (max_paths == 1) {
      parents.resize(tokens.size());
      for (size_t i = 0; i < tokens.size(); ++i) parents[i] = static_cast<int32_t>(i) - 1;
    }
    return py::make_tuple(py::cast(tokens), py::cast(parents), py::cast(probs), m);
  }

 private:
  void check(int sid) const {
    if (sid < 0 || static_cast<size_t>(sid) >= seqs_.size()) throw py::index_error("no such sequence id");
  }

  uint64_t hash(const std::vector<uint64_t>& h, size_t a, size_t b) const { return h[b] - h[a] * pow_[b - a]; }

  bool same_tail(const Occ& o, int k, const int32_t* ctx, int n) const {
    const auto& seq = seqs_[o.seq];
    for (int j = 1; j <= k; ++j)
      if (seq[o.pos - j] != ctx[n - j]) return false;
    return true;
  }

  // the best-first chain over the distinct continuations (PySuffixIndex._chain)
  void chain(const std::vector<Occ>& occ, int max_tokens, double min_token_prob, std::vector<int32_t>& tokens,
             std::vector<double>& probs) const {
    struct Item {
      const int32_t* begin;
      int len;
      int64_t weight;
    };
    std::vector<Item> items;               // distinct continuations, in order of first appearance
    for (const Occ& o : occ) {
      const auto& seq = seqs_[o.seq];
      int len = std::max(0, std::min<int>(max_tokens, static_cast<int>(seq.size()) - o.pos));
      const int32_t* b = seq.data() + o.pos;
      bool found = false;
      for (auto& it : items)
        if (it.len == len && std::equal(b, b + len, it.begin)) {
          it.weight += 1;
          found = true;
          break;
        }
      if (!found) items.push_back({b, len, 1});
    }
    double path = 1.0;
    for (int j = 0; j < max_tokens; ++j) {
      if (items.size() == 1) {             // one continuation left: the rest of it
        if (path >= min_token_prob)
          for (int q = j; q < items[0].len; ++q) {
            tokens.push_back(items[0].begin[q]);
            probs.push_back(1.0);
          }
        break;
      }
      std::map<int32_t, int64_t> counts;
      for (const auto& it : items)
        if (it.len > j) counts[it.begin[j]] += it.weight;
      if (counts.empty()) break;
      int32_t best = 0;
      int64_t best_c = -1, total = 0;
      for (const auto& kv : counts) {      // most frequent, then smallest token
        total += kv.second;
        if (kv.second > best_c) best = kv.first, best_c = kv.second;
      }
      double p = counts.size() > 1 ? static_cast<double>(best_c) / static_cast<double>(total) : 1.0;
      if (path * p < min_token_prob) break;
      path *= p;
      tokens.push_back(best);
      probs.push_back(p);
      std::vector<Item> kept;
      for (const auto& it : items)
        if (it.len > j && it.begin[j] == best) kept.push_back(it);
      items.swap(kept);
    }
  }

  // the best-first token tree (PySuffixIndex.propose, max_paths > 1)
  void tree(const std::vector<Occ>& start, int max_tokens, int max_paths, double min_token_prob,
            std::vector<int32_t>& tokens, std::vector<int32_t>& parents, std::vector<double>& probs) const {
    std::vector<std::unique_ptr<Heads>> pool;
    std::priority_queue<Heads*, std::vector<Heads*>, HeadsOrder> heap;
    int64_t tie = 0;
    auto push = [&](const std::vector<Occ>& occ, int32_t parent, double path) {
      std::vector<int32_t> order;          // tokens in order of first appearance
      std::unordered_map<int32_t, std::vector<Occ>> groups;
      for (const Occ& o : occ) {
        const auto& seq = seqs_[o.seq];
        if (o.pos < static_cast<int32_t>(seq.size())) {
          auto& g = groups[seq[o.pos]];
          if (g.empty()) order.push_back(seq[o.pos]);
          g.push_back({o.seq, o.pos + 1});
        }
      }
      if (order.empty()) return;
      std::vector<std::pair<int64_t, int32_t>> kids;   // (count, token)
      int64_t total = 0;
      for (int32_t t : order) {
        kids.emplace_back(static_cast<int64_t>(groups[t].size()), t);
        total += static_cast<int64_t>(groups[t].size());
      }
      std::sort(kids.begin(), kids.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
      });
      const size_t take = std::min<size_t>(kids.size(), static_cast<size_t>(max_paths));
      for (size_t i = 0; i < take; ++i) {
        double p = kids.size() > 1 ? static_cast<double>(kids[i].first) / static_cast<double>(total) : 1.0;
        if (path * p < min_token_prob) break;
        ++tie;
        pool.push_back(std::make_unique<Heads>(Heads{-path * p, tie, kids[i].second, p, parent,
                                                     std::move(groups[kids[i].second])}));
        heap.push(pool.back().get());
      }
    };
    std::vector<int> kept_children{0};     // per kept node, plus slot 0 for the root
    int leaves = 0;
    push(start, -1, 1.0);
    while (!heap.empty() && static_cast<int>(tokens.size()) < max_tokens) {
      Heads* e = heap.top();
      heap.pop();
      if (kept_children[e->parent + 1] > 0) {          // a new branch
        if (leaves >= max_paths) continue;
        ++leaves;
      } else if (e->parent < 0) {
        leaves = 1;
      }
      kept_children[e->parent + 1] += 1;
      tokens.push_back(e->token);
      parents.push_back(e->parent);
      probs.push_back(e->prob);
      kept_children.push_back(0);
      if (e->occ.size() == 1 && heap.empty()) {        // one occurrence, no rival: its sequence's rest
        const auto& seq = seqs_[e->occ[0].seq];
        int q = e->occ[0].pos;
        int want = max_tokens - static_cast<int>(tokens.size());
        int end = std::min<int>(static_cast<int>(seq.size()), q + std::max(want, 0));
        for (int j = q; j < end; ++j) {
          tokens.push_back(seq[j]);
          parents.push_back(static_cast<int32_t>(tokens.size()) - 2);
          probs.push_back(1.0);
        }
        break;
      }
      push(e->occ, static_cast<int32_t>(tokens.size()) - 1, -e->neg_path);
    }
  }

  std::vector<int> keys_;
  int min_len_, max_len_;
  int64_t max_occ_;
  std::vector<Table> tables_;
  std::vector<std::vector<int32_t>> seqs_;
  std::vector<std::vector<uint64_t>> prefix_;
  std::vector<uint64_t> pow_;
  int64_t num_tokens_ = 0;
};

// Index.propose for many (index, context) pairs in one call, the speculator's drafting of a
// step's rows (one Python call per source and step instead of one per row): contexts are
// one flat token list, context i its tokens ends[i - 1] .. ends[i] (ends[-1] = 0); index i
// proposes with excludes[i] and max_tokens[i]. Results in order: None or (tokens, parents,
// probs, match_len), each what Index.propose returns for the same arguments.
py::list propose_many(const std::vector<const Index*>& indexes, const std::vector<int32_t>& tokens,
                      const std::vector<int64_t>& ends, const std::vector<int>& excludes,
                      const std::vector<int>& max_tokens, int max_paths, double min_token_prob,
                      double tokens_per_match) {
  const size_t n = indexes.size();
  if (ends.size() != n || excludes.size() != n || max_tokens.size() != n)
    throw py::value_error("propose_many: indexes, ends, excludes and max_tokens differ in length");
  py::list out(n);
  int64_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    if (indexes[i] == nullptr) throw py::value_error("propose_many: an index is None");
    if (ends[i] < start || ends[i] > static_cast<int64_t>(tokens.size()))
      throw py::value_error("propose_many: ends must be non-decreasing and within tokens");
    out[i] = indexes[i]->propose_at(tokens.data() + start, static_cast<int>(ends[i] - start), max_tokens[i],
                                    max_paths, min_token_prob, tokens_per_match, excludes[i]);
    start = ends[i];
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_suffix_index, m) {
  m.doc() = "Native core of tailrl.speculative.sources.suffix_index (see that module for the contract).";
  py::class_<Index>(m, "Index")
      .def(py::init<std::vector<int>, int, int, int64_t>())
      .def("add", &Index::add)
      .def("extend", &Index::extend)
      .def("tokens", &Index::tokens)
      .def("size", &Index::size)
      .def("num_tokens", &Index::num_tokens)
      .def("match", &Index::py_match)
      .def("continuations", &Index::continuations)
      .def("propose", &Index::propose);
  m.def("propose_many", &propose_many);
}
