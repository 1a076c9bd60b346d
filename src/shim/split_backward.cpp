// Zero-bubble pipelines' split backward (Qi et al., ICLR 2024): a chunk's backward of one
// micro-batch in two passes over libtorch's autograd graph, which tch cannot express (it has
// no access to the graph's nodes):
//
// - B (hpc_backward_input): the gradient of the chunk's input, which the previous stage waits
//   for. The graph is kept. On the way, the gradient flowing into each "intermediate" node is
//   captured: a node on the path from the output to the input that also has an edge off that
//   path leading to parameters (a linear layer's addmm, whose other edges go to its weight and
//   bias). Only the nodes on the input's path run, and each computes only the gradients that
//   lead to the input (libtorch's task_should_compute_output), so no weight gradient is made.
// - W (hpc_backward_weight): from each intermediate, with the gradient B captured for it, the
//   gradients of the parameters its off-path edges lead to, accumulated into .grad by
//   libtorch's own AccumulateGrad (as torch.autograd.backward(..., inputs=params) does), so
//   the sums are those of an unsplit backward. Only the intermediate and its off-path nodes run.
//
// PyTorch's pipelining splits the same way (torch/distributed/pipelining/_backward.py:
// stage_backward_input, stage_backward_weight); the intermediates here are found by one walk
// of the graph, and a node with several inputs (a split of q, k and v) passes each of them on.
//
// A parameter reached from two intermediates (a weight used twice in the chunk) would have its
// gradient from one intermediate's pass flow through the other's: such a graph is refused with
// a message, as are chunks whose input needs no gradient (the first chunk: its backward is all
// W, which the caller runs as one ordinary backward).

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros_like.h>

#include "write_error.h"

#include <exception>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::edge_list;
using torch::autograd::variable_list;

// One intermediate: where W starts, with the gradients B captured for its inputs, and the
// parameters W accumulates from it.
struct Intermediate {
  std::shared_ptr<Node> node;
  std::vector<at::Tensor> captured;  // per input of the node (undefined: no gradient came)
  edge_list parameters;              // the AccumulateGrad edges its off-path edges reach
};

struct SplitState {
  std::vector<Intermediate> intermediates;
};

// The walk: which nodes reach the input (on the path), and which parameters each off-path node
// reaches. Recursion depth is the graph's depth (a chunk's layers: hundreds at most).
struct Walk {
  const Node *input_node;
  std::unordered_map<const Node *, size_t> parameter_of;  // AccumulateGrad node -> parameter index
  std::unordered_map<const Node *, bool> on_path;
  std::unordered_map<const Node *, std::vector<size_t>> reaches;

  bool reaches_input(const Node *n) {
    auto found = on_path.find(n);
    if (found != on_path.end()) return found->second;
    bool on = n == input_node;
    on_path[n] = false;  // a graph has no cycles; this only guards the recursion
    for (const auto &e : n->next_edges()) {
      if (e.function && reaches_input(e.function.get())) on = true;
    }
    on_path[n] = on;
    return on;
  }

  const std::vector<size_t> &parameters_reached(const Node *n) {
    auto found = reaches.find(n);
    if (found != reaches.end()) return found->second;
    std::vector<size_t> all;
    auto p = parameter_of.find(n);
    if (p != parameter_of.end()) all.push_back(p->second);
    for (const auto &e : n->next_edges()) {
      if (!e.function) continue;
      for (size_t i : parameters_reached(e.function.get())) all.push_back(i);
    }
    return reaches[n] = all;
  }
};

using hpc_shim::write_error;

}  // namespace

extern "C" {

// B. `output`: the chunk's output (or its scalar loss); `gradient`: its gradient, or null for a
// scalar loss (then 1); `input`: the chunk's input, a leaf that requires a gradient;
// `parameters`: the chunk's parameters (n of them). Writes the input's gradient as a new tch
// tensor into *input_gradient and the state W needs into *state (free it with
// hpc_split_state_free, after W or instead of it). Returns 0, or -1 with a message in `error`.
int hpc_backward_input(void *output, void *gradient, void *input, void **parameters, size_t n, void **input_gradient,
                       void **state, char *error, size_t error_length) {
  try {
    auto &out = *static_cast<at::Tensor *>(output);
    auto &x = *static_cast<at::Tensor *>(input);
    if (!x.requires_grad() || x.grad_fn()) {
      write_error(error, error_length, "the split backward needs a chunk input that is a leaf requiring a gradient");
      return -1;
    }
    Walk walk;
    auto input_edge = torch::autograd::impl::gradient_edge(x);
    walk.input_node = input_edge.function.get();
    for (size_t i = 0; i < n; ++i) {
      auto &p = *static_cast<at::Tensor *>(parameters[i]);
      if (!p.requires_grad()) continue;
      walk.parameter_of[torch::autograd::impl::grad_accumulator(p).get()] = i;
    }
    auto root = torch::autograd::impl::gradient_edge(out);
    if (!root.function) {
      write_error(error, error_length, "the chunk's output has no gradient function");
      return -1;
    }
    // Every node on the input's path with an edge off it that leads to parameters.
    auto split = std::make_unique<SplitState>();
    std::unordered_set<const Node *> seen;
    std::unordered_map<size_t, const Node *> owner;  // parameter -> its intermediate
    std::vector<std::shared_ptr<Node>> stack{root.function};
    while (!stack.empty()) {
      auto node = stack.back();
      stack.pop_back();
      if (!seen.insert(node.get()).second || !walk.reaches_input(node.get())) continue;
      Intermediate here{node, {}, {}};
      for (const auto &e : node->next_edges()) {
        if (!e.function) continue;
        if (walk.reaches_input(e.function.get())) {
          stack.push_back(e.function);
          continue;
        }
        for (size_t i : walk.parameters_reached(e.function.get())) {
          auto [slot, fresh] = owner.emplace(i, node.get());
          if (!fresh && slot->second != node.get()) {
            write_error(error, error_length, "a parameter is reached from two places of the chunk's graph (a weight used twice): the split backward cannot take it");
            return -1;
          }
          auto &p = *static_cast<at::Tensor *>(parameters[i]);
          Edge edge(torch::autograd::impl::grad_accumulator(p), 0);
          bool listed = false;
          for (const auto &q : here.parameters) listed = listed || q.function == edge.function;
          if (!listed) here.parameters.push_back(edge);
        }
      }
      if (!here.parameters.empty()) split->intermediates.push_back(std::move(here));
    }
    // B: run to the input, capturing every input of every intermediate on the way.
    edge_list outputs{input_edge};
    for (const auto &m : split->intermediates) {
      for (uint32_t i = 0; i < m.node->num_inputs(); ++i) outputs.emplace_back(m.node, i);
    }
    at::Tensor seed = gradient ? *static_cast<at::Tensor *>(gradient) : at::ones_like(out);
    variable_list grads = torch::autograd::Engine::get_default_engine().execute(
        {root}, {seed}, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, outputs);
    size_t k = 1;
    for (auto &m : split->intermediates) {
      for (uint32_t i = 0; i < m.node->num_inputs(); ++i) m.captured.push_back(grads[k++]);
    }
    *input_gradient = new at::Tensor(grads[0].defined() ? grads[0] : at::zeros_like(x));
    *state = split.release();
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// W: for each intermediate of `state` (hpc_backward_input's), accumulates the gradients of its
// parameters into their .grad and lets its part of the graph go. The state stays the caller's
// to free. Returns 0, or -1 with a message in `error`.
int hpc_backward_weight(void *state, char *error, size_t error_length) {
  try {
    auto *split = static_cast<SplitState *>(state);
    auto &engine = torch::autograd::Engine::get_default_engine();
    for (auto &m : split->intermediates) {
      edge_list roots;
      variable_list seeds;
      for (uint32_t i = 0; i < m.captured.size(); ++i) {
        if (!m.captured[i].defined()) continue;
        roots.emplace_back(m.node, i);
        seeds.push_back(m.captured[i]);
      }
      if (!roots.empty()) {
        engine.execute(roots, seeds, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true, m.parameters);
      }
      m.captured.clear();
      m.node.reset();
    }
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// The bytes of the gradients `state` (hpc_backward_input's) captured for W, each storage counted
// once (a captured gradient may be the seed itself, or share its storage). Between B and W these
// are held on top of the graph that an unsplit backward would have let go at once.
size_t hpc_split_state_bytes(void *state) {
  const auto *split = static_cast<const SplitState *>(state);
  std::unordered_set<const void *> seen;
  size_t bytes = 0;
  for (const auto &m : split->intermediates) {
    for (const auto &g : m.captured) {
      if (g.defined() && g.has_storage() && seen.insert(g.storage().data()).second) bytes += g.storage().nbytes();
    }
  }
  return bytes;
}

void hpc_split_state_free(void *state) { delete static_cast<SplitState *>(state); }

}  // extern "C"
