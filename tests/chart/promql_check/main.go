// Command promql-check reads a JSON list of {"where", "expr"} from stdin and parses every expr with
// Prometheus's own PromQL parser, and every "for"/"window" duration with its duration parser.
// It prints one line per problem and exits 1 when there is any. The chart tests run it on the
// dashboard's queries and the PrometheusRule's expressions (tests/chart/test_chart_monitoring.py).
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
)

type item struct {
	Where    string `json:"where"`
	Expr     string `json:"expr,omitempty"`
	Duration string `json:"duration,omitempty"`
}

func main() {
	var items []item
	if err := json.NewDecoder(os.Stdin).Decode(&items); err != nil {
		fmt.Fprintln(os.Stderr, "reading stdin:", err)
		os.Exit(2)
	}
	promql := parser.NewParser(parser.Options{})
	problems := 0
	for _, it := range items {
		if it.Expr != "" {
			if _, err := promql.ParseExpr(it.Expr); err != nil {
				fmt.Printf("%s: %v\n", it.Where, err)
				problems++
			}
		}
		if it.Duration != "" {
			if _, err := model.ParseDuration(it.Duration); err != nil {
				fmt.Printf("%s: %v\n", it.Where, err)
				problems++
			}
		}
	}
	fmt.Printf("%d checked, %d problems\n", len(items), problems)
	if problems > 0 {
		os.Exit(1)
	}
}
