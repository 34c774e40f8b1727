#ifndef DDP_EXAMPLES_TRAINER_SVG_CHART_H_
#define DDP_EXAMPLES_TRAINER_SVG_CHART_H_

// Line charts as standalone SVG documents (no scripts, no external fonts or
// files), so that a browser, an image viewer or a Markdown page shows them
// as they are. Panels are stacked vertically and share the x axis.

#include <string>
#include <utility>
#include <vector>

namespace ddp::examples::trainer {

/// One line (and optionally dots at its points).
struct ChartSeries {
  std::string name;                            ///< Shown in the legend.
  std::string color;                           ///< "#1f77b4".
  std::vector<std::pair<double, double>> points;  ///< (x, y), x ascending.
  bool markers = false;                        ///< Dots at every point.
  bool dashed = false;
};

/// One panel: a y axis and its series.
struct ChartPanel {
  std::string y_label;
  std::vector<ChartSeries> series;
  bool percent = false;  ///< y tick labels as "85%" (values are fractions).
  bool y_from_zero = false;  ///< Include 0 in the y range.
};

/// A vertical marker across every panel (an epoch boundary).
struct ChartMark {
  double x = 0;
  std::string label;
};

/// The whole chart.
struct Chart {
  std::string title;
  std::string subtitle;
  std::string x_label;
  std::vector<ChartPanel> panels;
  std::vector<ChartMark> marks;
  bool x_integer = true;  ///< x tick labels without decimals.
  int width = 960;
  int panel_height = 280;
};

/// Colours used by the trainer's chart (matplotlib's first three).
inline constexpr char kTrainLossColor[] = "#1f77b4";
inline constexpr char kTestLossColor[] = "#ff7f0e";
inline constexpr char kAccuracyColor[] = "#2ca02c";

/// The chart as an SVG document. Series with no points are listed in the
/// legend only; a panel with no points at all shows "no data yet".
std::string RenderSvgChart(const Chart& chart);

/// Tick positions for [lo, hi]: about `target` round values (1, 2, 2.5, 5 x
/// 10^k steps) covering the range. With `integer`, only whole steps of 1 or
/// more (an axis of steps or ranks: no ticks between its values).
std::vector<double> NiceTicks(double lo, double hi, int target, bool integer = false);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_SVG_CHART_H_
