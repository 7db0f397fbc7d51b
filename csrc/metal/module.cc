// The Python module _sgrnn_mps: the MPSGraph handlers' registrations, the Metal device name
// and the self-check of MPSGraph against the semantics.
#include "metal/mps_device.h"
#include "metal/self_check.h"
#include "pybind11/pybind11.h"
#include "sgrnn/handlers.h"
#include "sgrnn/module.h"
#include "sgrnn/targets.h"

namespace py = pybind11;

namespace {

// The report as jax_sgrnn.mps_self_check() documents it.
py::dict ReportToDict(const sgrnn::mps::Report& report) {
  using namespace sgrnn::mps;
  py::dict facts;
  for (int f = 0; f < kFactCount; ++f) {
    const FactVerdict& v = report.facts[f];
    py::dict fact;
    fact["status"] = StatusName(v.status);
    fact["statement"] = FactStatement(static_cast<Fact>(f));
    fact["worst_error"] = v.worst_error;
    fact["tolerance"] = v.tolerance;
    fact["where"] = v.where;
    fact["comparisons"] = v.comparisons;
    facts[FactName(static_cast<Fact>(f))] = fact;
  }
  py::dict out;
  out["passed"] = report.passed();
  out["failed_fact"] = report.passed() ? py::object(py::none())
                                       : py::object(py::str(FactName(report.first_failure())));
  out["problems"] = report.problems;
  out["seconds"] = report.seconds;
  out["facts"] = facts;
  return out;
}

}  // namespace

PYBIND11_MODULE(_sgrnn_mps, m) {
  m.doc() = "jax_sgrnn's XLA FFI handlers that run MPSGraph's single-gate RNN on the Apple GPU";
  sgrnn::DefineRegistrations(m, sgrnn::kMpsTargets, sgrnn::MpsForward, sgrnn::MpsGradients);
  m.def("device_name", &sgrnn::MpsDeviceName,
        "The default Metal device's name, or '' when there is none.");
  m.def(
      "self_check", []() { return ReportToDict(sgrnn::MpsSelfCheck()); },
      "Runs the self-check's problems through the MPSGraph handler; returns the report "
      "(jax_sgrnn.mps_self_check documents it).");
}
