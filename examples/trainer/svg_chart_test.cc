#include "examples/trainer/svg_chart.h"

#include <regex>
#include <string>

#include "gtest/gtest.h"

namespace ddp::examples::trainer {
namespace {

TEST(NiceTicksTest, RoundStepsCoverTheRange) {
  EXPECT_EQ(NiceTicks(0, 100, 5), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  const std::vector<double> acc = NiceTicks(0.61, 0.89, 5);
  ASSERT_EQ(acc.size(), 2u);
  EXPECT_NEAR(acc[0], 0.7, 1e-12);
  EXPECT_NEAR(acc[1], 0.8, 1e-12);
  EXPECT_EQ(NiceTicks(0.5, 1.0, 5).size(), 6u);  // 0.5, 0.6, ..., 1.0
  EXPECT_EQ(NiceTicks(0, 938, 8), (std::vector<double>{0, 200, 400, 600, 800}));
  EXPECT_TRUE(NiceTicks(1, 1, 5).empty());
  // An integer axis takes whole steps of at least 1.
  EXPECT_EQ(NiceTicks(0, 19.38, 8), (std::vector<double>{0, 2.5, 5, 7.5, 10, 12.5, 15, 17.5}));
  EXPECT_EQ(NiceTicks(0, 19.38, 8, true), (std::vector<double>{0, 5, 10, 15}));
  EXPECT_EQ(NiceTicks(0, 3.06, 8, true), (std::vector<double>{0, 1, 2, 3}));
  EXPECT_EQ(NiceTicks(0, 0.5, 5, true), (std::vector<double>{0}));
  EXPECT_EQ(NiceTicks(0, 2000, 8, true), (std::vector<double>{0, 250, 500, 750, 1000, 1250, 1500, 1750, 2000}));
}

Chart Example() {
  Chart c;
  c.title = "cnn on fashion_mnist <2 ranks>";
  c.x_label = "step";
  ChartPanel loss;
  loss.y_label = "loss";
  loss.series.push_back({"train loss", kTrainLossColor, {{10, 2.3}, {20, 1.1}, {30, 0.7}}, false, false});
  ChartPanel acc;
  acc.y_label = "accuracy";
  acc.percent = true;
  acc.series.push_back({"test accuracy", kAccuracyColor, {{30, 0.81}}, true, false});
  c.panels = {loss, acc};
  c.marks = {{30, "epoch 1"}};
  return c;
}

TEST(SvgChartTest, IsAStandaloneDocumentWithEverySeries) {
  const std::string svg = RenderSvgChart(Example());
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("stroke=\"#1f77b4\""), std::string::npos);
  EXPECT_NE(svg.find("fill=\"#2ca02c\""), std::string::npos);
  EXPECT_NE(svg.find("&lt;2 ranks&gt;"), std::string::npos) << "text is escaped";
  EXPECT_NE(svg.find(">epoch 1<"), std::string::npos);
  EXPECT_NE(svg.find(">80%<"), std::string::npos) << "percent ticks";
  EXPECT_EQ(svg.find("<script"), std::string::npos);
  EXPECT_EQ(svg.find("href"), std::string::npos) << "no external resources";
}

TEST(SvgChartTest, EmptyPanelsSayNoData) {
  Chart c;
  c.panels.resize(1);
  c.panels[0].series.push_back({"loss", kTrainLossColor, {}, false, false});
  const std::string svg = RenderSvgChart(c);
  EXPECT_NE(svg.find("no data yet"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
}

// A scaling efficiency above 100% (a superlinear run) lies inside its panel:
// the panel's range grows to the data. (Before, the top was capped at 102%:
// the line was clipped and the markers drawn above the panel, over the
// legend.)
TEST(SvgChartTest, PercentPanelsCoverValuesAbove100Percent) {
  Chart c;
  c.x_label = "ranks";
  ChartPanel eff;
  eff.y_label = "scaling efficiency";
  eff.percent = true;
  eff.y_from_zero = true;
  eff.series.push_back({"efficiency", kAccuracyColor, {{1, 1.0}, {2, 1.31}, {4, 0.9}}, true, false});
  c.panels = {eff};
  const std::string svg = RenderSvgChart(c);
  std::smatch panel;
  ASSERT_TRUE(std::regex_search(
      svg, panel,
      std::regex(R"re(<rect x="\d+" y="(\d+)" width="\d+" height="(\d+)" fill="#fafafa")re")))
      << svg;
  const double top = std::stod(panel[1]);
  const double bottom = top + std::stod(panel[2]);
  const std::regex circle(R"re(<circle cx="[-0-9.]+" cy="([-0-9.]+)")re");
  int markers = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), circle);
       it != std::sregex_iterator(); ++it) {
    const double cy = std::stod((*it)[1]);
    EXPECT_GE(cy, top) << (*it)[0];
    EXPECT_LE(cy, bottom) << (*it)[0];
    ++markers;
  }
  EXPECT_EQ(markers, 3);
  // Fractions up to 100% keep the panel's top at 102%: a 100% marker stays
  // close under it.
  Chart below = c;
  below.panels[0].series[0].points = {{1, 1.0}, {2, 0.95}};
  const std::string below_svg = RenderSvgChart(below);
  std::smatch first;
  ASSERT_TRUE(std::regex_search(below_svg, first, circle)) << below_svg;
  EXPECT_GE(std::stod(first[1]), top);
  EXPECT_LT(std::stod(first[1]) - top, 0.03 * (bottom - top)) << first[0];
}

// Every tick's label reads as the value at its place: ticks are evenly
// spaced, so the labels must be too. NiceTicks' steps of 2.5 (19 steps on x,
// 80% to 90% on y) were labelled with too few decimals: 0, 3, 5, 8, 10 and
// 80%, 82%, 85%, 88%, 90%.
TEST(SvgChartTest, TickLabelsAreTheTicksValues) {
  Chart c;
  c.x_label = "step";
  ChartPanel acc;
  acc.y_label = "test accuracy";
  acc.percent = true;
  ChartSeries series{"test accuracy", kAccuracyColor, {}, true, false};
  for (int i = 1; i <= 19; ++i) series.points.emplace_back(i, 0.80 + 0.1 * (i - 1) / 18.0);
  acc.series = {series};
  c.panels = {acc};
  const std::string svg = RenderSvgChart(c);
  // (position, value) of each axis' labels: x labels are centred below the
  // panel, y labels end left of it.
  std::vector<std::pair<double, double>> x_ticks, y_ticks;
  const std::regex label(
      R"re(<text x="([-0-9.]+)" y="([-0-9.]+)" font-size="11" fill="#555" text-anchor="(middle|end)">([^<]*)</text>)re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), label); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    const bool x_axis = m[3] == "middle";
    std::string text = m[4];
    if (!x_axis) {
      ASSERT_EQ(text.back(), '%') << m[0];
      text.pop_back();
    }
    (x_axis ? x_ticks : y_ticks).emplace_back(std::stod(x_axis ? m[1] : m[2]), std::stod(text));
  }
  for (const auto* ticks : {&x_ticks, &y_ticks}) {
    ASSERT_GE(ticks->size(), 3u) << svg;
    const auto& first = ticks->front();
    const auto& second = (*ticks)[1];
    const double per_unit = (second.first - first.first) / (second.second - first.second);
    for (const auto& [at, value] : *ticks) {
      EXPECT_NEAR(at, first.first + (value - first.second) * per_unit, 0.2)
          << "label " << value << " at " << at << " (the first two: " << first.second << " at "
          << first.first << ", " << second.second << " at " << second.first << ")";
    }
  }
}

// The step axis is an integer axis: a run of 3 steps was labelled 0, 0.5,
// 1, ... 3, and one of 19 steps 0, 2.5, 5, 7.5, ..., places no step has.
TEST(SvgChartTest, StepAxisHasWholeNumberTicks) {
  for (int steps : {3, 19}) {
    Chart c;
    c.x_label = "step";
    ChartPanel loss;
    loss.y_label = "loss";
    ChartSeries series{"train loss", kTrainLossColor, {}, false, false};
    for (int i = 1; i <= steps; ++i) series.points.emplace_back(i, 1.0 / i);
    loss.series = {series};
    c.panels = {loss};
    const std::string svg = RenderSvgChart(c);
    const std::regex label(
        R"re(<text x="[-0-9.]+" y="[-0-9.]+" font-size="11" fill="#555" text-anchor="middle">([^<]*)</text>)re");
    int labels = 0;
    for (auto it = std::sregex_iterator(svg.begin(), svg.end(), label); it != std::sregex_iterator();
         ++it) {
      const std::string text = (*it)[1];
      EXPECT_EQ(text.find('.'), std::string::npos) << steps << " steps: x label " << text;
      ++labels;
    }
    EXPECT_GE(labels, 3) << svg;
  }
}

}  // namespace
}  // namespace ddp::examples::trainer
